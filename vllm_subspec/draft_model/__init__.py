"""draft_model"""
