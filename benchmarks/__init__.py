"""The benchmarks (python -m benchmarks.<name>.run). A regular package, not a namespace one: Opacus 1.6 (the privacy
extra) installs a top-level package of the same name, which would otherwise hide this one."""
