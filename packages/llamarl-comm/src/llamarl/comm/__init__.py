"""llamarl.comm"""
