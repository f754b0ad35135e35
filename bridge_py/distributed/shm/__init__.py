"""The shared-memory foundation: files under ``/dev/shm``, segments, waits and liveness.

Everything above it (a StatelessProcessGroup's board and large values, the MessageQueue's
ring, the CPU all-reduce, ModelOpt's gathers) makes and opens its shared memory here.
"""
