"""Graph passes of autoshard, installed as ``autoshard.passes``."""
