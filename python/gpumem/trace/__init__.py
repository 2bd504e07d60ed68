"""Recorded memory traces: snapshot_file reads a snapshot of torch.cuda.memory._dump_snapshot as
hostile input (plain_data: the pickle reader it uses), and replay runs one through gpumem's
allocator on a simulated device under a limit."""
