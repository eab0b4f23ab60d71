"""Drop-in APIs of other training libraries on deepshard: ``import deepshard.compat.deepspeed as deepspeed``."""
