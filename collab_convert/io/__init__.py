"""Files only: model folders (resolve, config, copy, staged output), tensors (lazy reader, shard writer),
text inputs. Nothing here knows the math or the model families."""
