"""Images in prompts: the vision tower, image preprocessing and the M-RoPE positions of image spans."""
