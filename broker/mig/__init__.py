"""MIG planning: layouts from the waiting work, mig-parted config and gres.conf, the
waiting MIG work.
"""
