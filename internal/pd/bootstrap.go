package pd

import (
	"encoding/json"
	"math/rand/v2"
	"strconv"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/worker"
)

// SGLang bootstrap legs: both legs carry the prefill's bootstrap address and a room, and the
// engines rendezvous by room.

// BootstrapBodies returns the prefill and decode leg bodies: the client's bytes plus
// bootstrap_host, bootstrap_port and bootstrap_room (arrays of length N for a batch of N, with a
// fresh room each), and, for workers with DP ranks, routed_dp_rank on each leg and
// disagg_prefill_dp_rank on the decode. Client values of these keys are replaced.
func BootstrapBodies(req *Request, pair worker.Pair) (prefill, decode []byte, err error) {
	prefill, decode, _, _, err = bootstrapLegs(req, pair)
	return prefill, decode, err
}

// bootstrapLegs is BootstrapBodies, also returning the DP rank each leg runs on (-1: none).
func bootstrapLegs(req *Request, pair worker.Pair) (prefill, decode []byte, pRankOut, dRankOut int, err error) {
	pRankOut, dRankOut = -1, -1
	host, _ := json.Marshal(pair.Prefill.BootstrapHost)
	port := []byte("null")
	if p := pair.Prefill.BootstrapPort; p != nil {
		port = strconv.AppendInt(nil, int64(*p), 10)
	}
	// The prefill's rank is chosen first and every room agrees with it (room % dp_size == rank):
	// an SGLang prefill that follows the bootstrap room refuses a rank that does not, and a
	// decode that finds its prefill by room % dp_size would wait on another rank. Requests with
	// n > 1 samples are the exception below.
	pRank, pRanked := prefillRank(pair.Prefill, req, pair.Prefill.DPSize)
	newRoom := func() uint64 { return roomFor(pRank, pair.Prefill.DPSize) }
	if req.Samples > 1 {
		// SGLang sends each of n samples as a request of its own and gives a scalar room r to
		// request k as r + k (GenerateReqInput._normalize_bootstrap_params): consecutive rooms
		// land on consecutive DP ranks, which no one routed_dp_rank can agree with, and a list of
		// rooms is refused with n > 1 by some releases (repeated per sample, one room for several
		// requests, by others). So: one scalar room, and no rank pinned — the prefill follows
		// each sample's room, and the decode finds it by room % dp_size.
		pRanked = false
		newRoom = func() uint64 { return roomFor(0, 1) }
	}
	var room []byte
	if n := req.Batch; n > 0 && req.Samples <= 1 {
		hosts, ports, rooms := []byte{'['}, []byte{'['}, []byte{'['}
		for i := 0; i < n; i++ {
			if i > 0 {
				hosts, ports, rooms = append(hosts, ','), append(ports, ','), append(rooms, ',')
			}
			hosts, ports = append(hosts, host...), append(ports, port...)
			rooms = strconv.AppendUint(rooms, newRoom(), 10)
		}
		host, port, room = append(hosts, ']'), append(ports, ']'), append(rooms, ']')
	} else {
		room = strconv.AppendUint(nil, newRoom(), 10)
	}
	common := []openai.Field{{Key: "bootstrap_host", Value: host}, {Key: "bootstrap_port", Value: port}, {Key: "bootstrap_room", Value: room}}
	pFields, dFields := common, common
	// The DP rank fields are Baton's: a client's values never reach a leg, where they would
	// send the KV to a rank the other leg does not look at.
	pDel, dDel := []string{keyDPRankDeprecated, keyPrefillDPRank}, []string{keyDPRankDeprecated}
	if rank, ok := pRank, pRanked; ok {
		pRankOut = rank
		v := strconv.AppendInt(nil, int64(rank), 10)
		pFields = append(pFields[:len(pFields):len(pFields)], openai.Field{Key: keyRoutedDPRank, Value: v})
		dFields = append(dFields[:len(dFields):len(dFields)], openai.Field{Key: keyPrefillDPRank, Value: v})
	} else {
		pDel, dDel = append(pDel, keyRoutedDPRank), append(dDel, keyPrefillDPRank)
	}
	if rank, ok := pair.Decode.NextRank(); ok {
		dRankOut = rank
		dFields = append(dFields[:len(dFields):len(dFields)], openai.Field{Key: keyRoutedDPRank, Value: strconv.AppendInt(nil, int64(rank), 10)})
	} else {
		dDel = append(dDel, keyRoutedDPRank)
	}
	if prefill, err = openai.Edit(req.Body, pFields, pDel); err != nil {
		return nil, nil, -1, -1, err
	}
	if decode, err = openai.Edit(req.Body, dFields, dDel); err != nil {
		return nil, nil, -1, -1, err
	}
	return prefill, decode, pRankOut, dRankOut, nil
}

// SGLang's DP rank fields (python/sglang/srt/managers/io_struct.py): the rank a leg runs on,
// the prefill rank a decode pulls from, and the deprecated alias of the first.
const (
	keyRoutedDPRank     = "routed_dp_rank"
	keyPrefillDPRank    = "disagg_prefill_dp_rank"
	keyDPRankDeprecated = "data_parallel_rank"
)

// roomFor returns a bootstrap room, uniform in [0, 2^63-1] among those with room % dpSize ==
// rank (any room when the prefill has no DP ranks).
func roomFor(rank, dpSize int) uint64 {
	room := rand.Uint64() & (1<<63 - 1)
	if dpSize <= 1 {
		return room
	}
	n := uint64(dpSize)
	room = room - room%n + uint64(rank)
	if room > 1<<63-1 {
		room -= n
	}
	return room
}
