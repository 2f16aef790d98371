"""Code shared by the pipespec runtime and nodes."""
