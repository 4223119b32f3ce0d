"""The engine's plain-Python core, no torch: sequence.py -> block_manager.py -> scheduler.py (read in that order)."""
