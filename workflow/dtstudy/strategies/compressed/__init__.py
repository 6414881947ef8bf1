"""The compressed all-reduces: fp16 and bf16 casts, PowerSGD, 1-bit SGD. `spec` (torch-free: knobs,
checks, performance model), `strategy` (the implementations) and `onebit_codec` (1-bit SGD's
codec with error feedback)."""
