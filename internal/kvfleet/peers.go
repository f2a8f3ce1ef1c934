package kvfleet

import (
	"context"
	"net/netip"
	"net/url"
	"sync"
	"time"
)

// kvPeers says whether a KV event publisher's address is the worker's own: the worker URL's IP,
// or one its host name resolves to (looked up at most every peerTTL, bounded by peerLookup).
type kvPeers struct {
	mu    sync.Mutex
	hosts map[string]peerAddrs // by host name
	// lookup resolves a host name (net.DefaultResolver's LookupNetIP in production).
	lookup func(ctx context.Context, host string) ([]netip.Addr, error)
}

type peerAddrs struct {
	addrs []netip.Addr
	at    time.Time
}

const (
	peerTTL    = 30 * time.Second
	peerLookup = 2 * time.Second
	// maxPeerHosts bounds the cache: worker host names, not anything a publisher chooses.
	maxPeerHosts = 4096
)

// is reports whether peer may publish for the worker at workerURL.
func (p *kvPeers) is(workerURL string, peer netip.Addr) bool {
	u, err := url.Parse(workerURL)
	if err != nil || !peer.IsValid() {
		return false
	}
	host := u.Hostname()
	if a, err := netip.ParseAddr(host); err == nil {
		return a.Unmap() == peer
	}
	for _, a := range p.resolve(host) {
		if a.Unmap() == peer {
			return true
		}
	}
	return false
}

func (p *kvPeers) resolve(host string) []netip.Addr {
	p.mu.Lock()
	c, ok := p.hosts[host]
	p.mu.Unlock()
	if ok && time.Since(c.at) < peerTTL {
		return c.addrs
	}
	ctx, cancel := context.WithTimeout(context.Background(), peerLookup)
	defer cancel()
	addrs, err := p.lookup(ctx, host)
	if err != nil && ok {
		addrs = c.addrs // keep the last answer through a resolver hiccup
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.hosts == nil || len(p.hosts) >= maxPeerHosts {
		p.hosts = map[string]peerAddrs{}
	}
	p.hosts[host] = peerAddrs{addrs: addrs, at: time.Now()}
	return addrs
}
