"""What the kill -9 tests' zygotes share: a process that imported torch (or a framework) once forks a writer per
request, because those imports take seconds on a loaded machine and each kill needs a fresh writer."""

# Script text for a zygote, placed after its imports and set-up: each stdin line is a first step; the zygote answers
# with the forked child's pid, and the child goes on with the script text that follows, `step` set, at one indent.
FORK_PER_LINE = """
for line in sys.stdin:
    step = int(line)
    pid = os.fork()
    if pid:
        print(pid, flush=True)
        continue
"""
