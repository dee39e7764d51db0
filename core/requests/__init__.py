"""What a request asks for and how far each of its sequences has got: sampling parameters, the grammar
that constrains its output, and the sequences the scheduler, the runner and the engine share."""
