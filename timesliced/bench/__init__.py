"""Benchmark programs that print figures (``timesliced bench ...``) and the demo (``timesliced demo``).

Each module is one program; what they share is ``common``. Workers run as child processes
(``python -m timesliced.bench.<program> --worker ...``) so that every figure crosses a real socket.
"""
