"""Native CPU kernels: C sources (`csrc/`, every export declared in `csrc/kvyard_kernels.h`), their build
(`build`), header-checked ctypes bindings (`header`, `bindings`) and torch-facing wrappers (`ops`).

The lowest layer of kvyard's model code: it imports neither `kvyard.models` nor `kvyard.engine`."""
