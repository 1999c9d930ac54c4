"""Where collab-convert meets transformers' loaded models: loading collaborative checkpoints through a
registered quantization config, capturing calibration statistics, and measuring fidelity."""
