"""Backend adapters: turn engine calls into C++ core calls and own the file I/O around them."""
