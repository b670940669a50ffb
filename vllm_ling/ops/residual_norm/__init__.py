"""Residual add + RMSNorm for the decode step (``add_rms_norm.cu``), its plain-PyTorch reference and warm-up."""
