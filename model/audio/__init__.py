"""Audio input: decoding a clip to the tower's sample rate (decode.py), its log-mel features
(features.py) and the audio towers of families that take audio (gemma4.py)."""
