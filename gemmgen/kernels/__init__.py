"""The C ABI of compiled instances (ctypes bindings) and launching them on torch's current stream."""
