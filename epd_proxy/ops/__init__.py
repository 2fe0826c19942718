"""Operations: metrics, log formatting, the recent-requests window."""
