"""Models on disk: resolving ``model.path`` (the embedded model, a folder, a GGUF file, the local Hugging Face
cache), safe offline loading onto the rank's device, the weights checksum, and fetching the embedded model.
"""
