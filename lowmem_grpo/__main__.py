"""`python -m lowmem_grpo ...`: the CLI (what `lowmem-grpo train --nproc N` has torchrun start in each process)."""

from .cli import main

if __name__ == "__main__":
    main()
