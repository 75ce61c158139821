"""llamarl.algo"""
