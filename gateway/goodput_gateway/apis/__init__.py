"""APIs the gateway serves by translating them to the runtime's chat completions: OpenAI's Responses
(responses.py) and Anthropic's Messages (messages.py)."""
