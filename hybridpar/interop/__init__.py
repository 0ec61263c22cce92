"""Other formats: Hugging Face Llama folders (``hf``) and text generation (``generate``)."""
