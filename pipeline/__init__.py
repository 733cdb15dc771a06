"""zerosnake: raw text to a trained, consolidated and evaluated LM as a Snakemake DAG."""
