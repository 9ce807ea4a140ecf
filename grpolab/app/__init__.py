"""The application layer the command line calls: train and SFT of a config, the pipeline, ablate, the demo, rm, sharpen."""
