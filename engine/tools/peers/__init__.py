"""Other inference engines run on the same model and prompts, for comparison (llama.cpp)."""
