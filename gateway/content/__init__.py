"""content"""
