package h1

import (
	"net"
	"sync"
	"sync/atomic"
)

// DefaultMaxConns is the client connections a server holds at once unless told otherwise: half
// the process's descriptor limit, the other half kept for upstream connections (0: no limit
// known).
func DefaultMaxConns() int { return descriptorLimit() / 2 }

// LimitListener bounds the connections accepted from Listener and open at once to Max (0: no
// bound): one past it is closed as it arrives and counted in Refused, so that a flood of idle
// sockets cannot take the descriptors upstream connections need. It gives net/http's server
// the bound Server keeps itself.
type LimitListener struct {
	net.Listener
	Max     int
	Refused atomic.Uint64
	// OnRefuse, when set, is told of each connection refused.
	OnRefuse func()
	open     atomic.Int64
}

func (l *LimitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.Max > 0 && l.open.Add(1) > int64(l.Max) {
			l.open.Add(-1)
			l.Refused.Add(1) // counted before the client can see the close
			if l.OnRefuse != nil {
				l.OnRefuse()
			}
			_ = c.Close()
			continue
		}
		if l.Max <= 0 {
			return c, nil
		}
		return &limitedConn{Conn: c, l: l}, nil
	}
}

// limitedConn gives its place back once, when closed.
type limitedConn struct {
	net.Conn
	l    *LimitListener
	once sync.Once
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.l.open.Add(-1) })
	return err
}
