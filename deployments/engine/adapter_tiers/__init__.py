"""The engine's adapter tiers: device slots (slot_table.py) <- CPU memory (cpu_cache.py) <- the store,
and AdapterManager (manager.py), the scheduler's one view across them."""
