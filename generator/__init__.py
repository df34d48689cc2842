"""The code generator, shipped as gemmgen.generator: every family's instance space and validity rule
(families/, space), rendering into .cu sources (render), the ninja build driver (build), toolchain
discovery (toolchain) and the manifest each build directory carries (manifest).

What the runtime (the rest of gemmgen) may use of it, and nothing else (tests/test_layout.py checks):
- space and families: the instance spaces and their rules, the family contract;
- manifest: the schema the runtime reads built instances from;
- ondemand: the one entry point that compiles an instance while a program runs.
The `gemmgen generate` command is the generator's own front end (build.generate).
"""
