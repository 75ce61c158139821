"""llamarl.control"""
