"""The `candelabra` command's subcommands that are not a server or a client: `backends`,
`conformance` and `new-backend`, each a module with `add_arguments(parser)` and `run(args)` as `serve`
(core/server/launch.py), `chat` and `bench` (core/clients/) are."""
