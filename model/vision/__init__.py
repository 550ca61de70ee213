"""Vision towers of vision-language families and the image preprocessing they expect.

A tower turns preprocessed patches into one feature row per image-pad token; the family's text
model splices those rows into the prompt's embeddings (model/families/qwen2_5_vl.py).
"""
