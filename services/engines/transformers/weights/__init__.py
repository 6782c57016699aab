"""How a model's linear weights are held on the CPU: the GGUF file's own blocks
(blocks.py, matched to layers by value in gguf_match.py), packed for oneDNN
(packed.py), and q/k/v or gate/up fused into one product (fused.py)."""
