"""The network and how it is spread over devices: the Llama presets (`llama`), the data-parallel
strategy (`parallel`), the memory plan (`memory`, `hardware`) and the Hugging Face export (`export`)."""
