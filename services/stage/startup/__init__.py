"""A stage's start-up, every step an InitStatus phase:

phases.py       fetch -> device lock -> load -> memory plan -> warm-up -> READY
cache_dir.py    the cache directory, made and checked first (a bad one named)
init_bus.py     each phase published once, replayed to every InitStatus stream
fetch/          the model's files: local paths, pkg://, URLs, the hub (with progress)
device_lock.py  stages sharing a device initialise one at a time
memory.py       the memory planner: KV pages from free memory and the model's size
"""
