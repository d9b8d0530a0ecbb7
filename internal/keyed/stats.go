package keyed

// Stats returns the partition's keys with messages in flight (running or
// queued) and the messages queued behind their key's running one (or
// waiting for a worker), for the consumer lag metrics.
func (p *Partition[T]) Stats() (keys, waiting int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, q := range p.keys {
		n := len(q.items)
		if !q.waiting && n > 0 {
			n-- // items[0] is running
		}
		waiting += n
	}
	return len(p.keys), waiting
}
