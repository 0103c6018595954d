package prepare

// SectionsUnderWay is how many callers of locked (a rolling update's
// critical sections) have not returned yet.
func (m *Manager) SectionsUnderWay() int { return int(m.sections.Load()) }
