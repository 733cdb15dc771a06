"""``python -m pipeline.train {launch,worker} ...``."""

import sys


def main() -> int:
    usage = (
        "usage: python -m pipeline.train {launch,worker} [--help]\n"
        "  launch  submit a rendered run's training (submitit: local or Slurm) and wait\n"
        "  worker  one training process; started by torchrun on every rank\n"
    )
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(usage, end="")
        return 0 if len(sys.argv) >= 2 else 2
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "launch":
        from pipeline.train.launch import main as launch_main

        return launch_main(rest)
    if cmd == "worker":
        from pipeline.train.loop import main as worker_main

        return worker_main(rest)
    print(f"error: unknown command {cmd!r}\n{usage}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
