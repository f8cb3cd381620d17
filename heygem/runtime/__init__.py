"""What every stage runs on: the device and cuDNN (device), the C allocator (allocator), spawned
helper processes (processes), the stage runner (flow), what a worker keeps between jobs (kept) and
the filter that keeps the libraries' log lines off the terminal (library_logs)."""
