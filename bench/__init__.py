"""The benchmarks behind `trainpipe bench ...` (transfer, dataset, ckpt, overhead, repro): each measures trainpipe
against a peer in the same run on this machine and prints the figures and their ratios; none is a timed test.

May import infra, the bundled trainer's flags and the test suite's servers (rclone serve s3, the GCS emulator) that
they run against; the CLI imports them, nothing under infra/ or trainer/ does.
"""
