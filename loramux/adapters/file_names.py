"""The files of a PEFT adapter directory, and the size cap of its config. No torch: the HTTP front end names
them too (uploads)."""
CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few KB
