"""llamarl.exec"""
