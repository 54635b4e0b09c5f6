"""RTX 5060 Ti 16 GB (Blackwell, compute 12.0): the field report's card.

The derived launch plan for 16 GB is the report's command exactly
(moe cache 256, 4096 tokens, 1 running request).
"""

hardware_profile = "rtx5060ti_16gb"
decode_floor_tps = 18.0  # measured 22-24 tok/s; below 18 something is wrong
