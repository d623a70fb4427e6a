"""Compiler flags shared by setup.py (ahead-of-time build) and the JIT loader.

The ISA-specific translation units enable AVX-512 / AVX2 themselves with target pragmas, so the
library as a whole stays runnable on any x86-64 (and non-x86) CPU; dispatch happens at run time.
"""
CXX_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno"]
LD_FLAGS = ["-fopenmp"]
