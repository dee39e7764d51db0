"""Chat templates that offer tools the way each family's documentation describes its prompt
format, written for these tests (small, not the checkpoints' own files): they are what the
parser is picked from, and what tools and tool history must render through."""

# Hermes function calling: ChatML turns, the tools' signatures inside <tools></tools> in the
# system turn, calls inside <tool_call></tool_call>, results in <tool_response> on a "tool" turn.
HERMES = (
    "{% if tools %}<|im_start|>system\nYou are a function calling AI model. You may call one or more functions. "
    "Function signatures are within <tools></tools>:\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools>\nFor each call answer a JSON object with \"name\" and \"arguments\" inside <tool_call></tool_call>."
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% else %}{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Llama 3.1 JSON tool calling: header-delimited turns; with tools, "Environment: ipython" in the
# system turn and the functions in the user turn; the model answers a JSON object of "name" and
# "parameters" after <|python_tag|>, ending with <|eom_id|>; results come back on "ipython" turns.
LLAMA31 = (
    "<|begin_of_text|>{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython<|eot_id|>"
    "{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if tools and loop.last and m.role == 'user' %}Given the following functions, respond with a JSON for a "
    "function call with its proper arguments. Respond in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% if m.tool_calls %}<|python_tag|>{% for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}{% endfor %}<|eom_id|>"
    "{% else %}{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Llama 3.2 (1B/3B): the same turns; calls are written as bare JSON, without <|python_tag|>.
LLAMA32 = (
    "<|begin_of_text|>{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nYou have access to these "
    "functions; to call one, answer only {\"name\": function name, \"parameters\": arguments object}.\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Mistral (v3 tokenizer): [AVAILABLE_TOOLS] before the last user turn, calls as a JSON list after
# [TOOL_CALLS], results inside [TOOL_RESULTS] with the nine-character call id.
MISTRAL = (
    "<s>{% for m in messages %}"
    "{% if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] ["
    "{% for c in m.tool_calls %}{% if c.id|length != 9 %}{{ raise_exception('tool call ids are 9 characters') }}"
    "{% endif %}{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] {{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}"
    "[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
)

# A template that offers no tools: the families' markers appear nowhere.
PLAIN = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                  "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
