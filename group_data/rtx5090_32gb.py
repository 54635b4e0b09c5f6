"""RTX 5090 32 GB (Blackwell, compute 12.0): twice the VRAM, so the derived plan
doubles the expert cache and the KV tokens (docs/deploy.md, "Launch plan")."""

hardware_profile = "rtx5090_32gb"
decode_floor_tps = 40.0  # an estimate (no 5090 measured yet): about twice the 16 GB card
