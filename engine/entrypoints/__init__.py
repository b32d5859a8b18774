"""Entry points on top of EngineCore: the offline LLM / AsyncLLM, the OpenAI server, the CLI."""
