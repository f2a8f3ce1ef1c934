package httpwire

import "io"

// Source is what a connection's pooled read buffer reads from: the connection, or — inside
// FillWaiting's wait, where the connection's own Read would wait for the poller that is already
// waiting — its descriptor, read at once. An end or error FillWaiting met is the next read's.
type Source struct {
	Conn   io.Reader
	fd     uintptr
	direct bool
	err    error
}

func (s *Source) Read(p []byte) (int, error) {
	switch {
	case s.direct:
		return readNow(s.fd, p)
	case s.err != nil:
		err := s.err
		s.err = nil
		return 0, err
	}
	return s.Conn.Read(p)
}
