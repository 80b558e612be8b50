------------------------------- MODULE kvseal -------------------------------
(* The kvseal transfer protocol: the decode lease machine, the prefill transfer machine and the router request  *)
(* machine of kvseal/protocol/, over a network that loses and reorders messages, with a prefill worker that      *)
(* crashes, is fenced (rightly or wrongly), and clients that leave. Checked by TLC (tests/test_protocol_models). *)
(*                                                                                                              *)
(* A lease is a request's attempt: request RETRY is sent a second time under the same id once its first try     *)
(* ended (request ids are not unique over time). Leases are numbers (Req(l) is lease l's request), not pairs,   *)
(* and only the attempts that can happen exist: the same states as pairs, a seventh less of TLC's time. Each    *)
(* lease needs one decode page; there are fewer pages than requests. Request OVER fits decode's pool but never  *)
(* prefill's. Page bytes are abstracted to "which lease's bytes, whole or not", so a read of foreign bytes is a *)
(* comparison. Tenants: request r is tenant r % 2; pages are tagged with their owner, so the tag check compares *)
(* owners.                                                                                                      *)
(*                                                                                                              *)
(* Variant names a known-bad variant (kvseal.protocol.machine.Variants) or "safe".                             *)
EXTENDS Naturals, FiniteSets

CONSTANTS NR, NP, OVER, RETRY, MaxFaults, Variant

Reqs == 0..NR-1
\* lease l < NR is request l's first try; lease NR, when RETRY is a request, is RETRY's second
Leases == 0..(IF RETRY < NR THEN NR ELSE NR - 1)
Req(l) == IF l < NR THEN l ELSE RETRY
Lease(r, a) == IF a = 0 THEN r ELSE NR
Pages == 0..NP-1
NONE == <<>>
NOBODY == 99  \* the owner of a free page

\* message types, as in kvseal/transfer/messages.py
MsgTypes == {"Reserve", "Lease", "Prefill", "Commit", "Ack", "Abort", "WriterDone", "Fence", "Forget"}

\* the lease states of kvseal/protocol/decode.py, the transfer states of kvseal/protocol/prefill.py and the
\* request states of kvseal/protocol/router.py; "-" before a record exists, CLOSED once forgotten
LeaseStates == {"-", "RESERVED", "VERIFYING", "RUNNING", "QUARANTINED", "CLOSED"}
WriteStates == {"-", "COMPUTING", "WRITING", "COMMITTING", "CLOSED"}
RequestStates == {"-", "RESERVING", "TRANSFERRING", "FORGETTING", "STREAMING", "CLOSED"}

Nonce(l) == IF Variant = "lease_reuse" THEN Req(l) ELSE 100 + l

VARIABLES dl, dpg, lgen, capep, expired,   \* decode: lease state, page, generation, capability epoch, TTL passed
          pst, pown, pgen, pdat,            \* decode pool: page state, owner, generation, whose bytes
          epoch,                            \* the prefill writer's epoch on decode
          xs, xfull, forgotten, pup,        \* prefill: transfer state, whole prompt computed, refused nonces, up
          rq, att, gone, outcome, corrupt,  \* router and clients
          net, late, faults,                \* in-flight messages; copies the network will deliver again later;
                                            \* faults so far (of any kind, MaxFaults at most)
          leak, badwrite, stale             \* safety flags, set by the step that breaks a property

vars == <<dl, dpg, lgen, capep, expired, pst, pown, pgen, pdat, epoch, xs, xfull, forgotten, pup,
          rq, att, gone, outcome, corrupt, net, late, faults, leak, badwrite, stale>>

Init ==
    /\ dl = [l \in Leases |-> "-"] /\ dpg = [l \in Leases |-> 0] /\ lgen = [l \in Leases |-> 0]
    /\ capep = [l \in Leases |-> 0] /\ expired = [l \in Leases |-> FALSE]
    /\ pst = [p \in Pages |-> "FREE"] /\ pown = [p \in Pages |-> NOBODY] /\ pgen = [p \in Pages |-> 0]
    /\ pdat = [p \in Pages |-> NONE] /\ epoch = 0
    /\ xs = [l \in Leases |-> "-"] /\ xfull = [l \in Leases |-> TRUE] /\ forgotten = {} /\ pup = TRUE
    /\ rq = [r \in Reqs |-> "-"] /\ att = [r \in Reqs |-> 0] /\ gone = [l \in Leases |-> FALSE]
    /\ outcome = [l \in Leases |-> "open"] /\ corrupt = [l \in Leases |-> FALSE]
    /\ net = {} /\ late = {} /\ faults = 0
    /\ leak = FALSE /\ badwrite = FALSE /\ stale = FALSE

Send(m) == net' = net \cup {m}
Recv(m) == net' = net \ {m}
Msg(t, l, x) == [t |-> t, l |-> l, x |-> x]
Cur(r) == Lease(r, att[r])
Open(l) == dl[l] \in {"RESERVED", "VERIFYING", "QUARANTINED", "RUNNING"}
\* decode finds a lease by request id, then compares nonces (kvseal/protocol/decode.py)
DecodeLease(l) == {k \in Leases : Req(k) = Req(l) /\ Open(k) /\ Nonce(k) = Nonce(l)}
FreePage(p) == /\ pst' = [pst EXCEPT ![p] = "FREE"] /\ pown' = [pown EXCEPT ![p] = NOBODY]
               /\ pgen' = [pgen EXCEPT ![p] = IF Variant = "lease_reuse" THEN @ ELSE @ + 1]
End(l, s) == outcome' = [outcome EXCEPT ![l] = IF @ = "open" THEN s ELSE @]

Unchanged(vs) == UNCHANGED vs
PoolVars == <<pst, pown, pgen, pdat>>
DecVars == <<dl, dpg, lgen, capep, expired>>
PreVars == <<xs, xfull, forgotten, pup>>
RtrVars == <<rq, att, gone, outcome, corrupt>>
Flags == <<leak, badwrite, stale>>

(* ---------------------------------------- router ---------------------------------------------------------- *)
\* - --start--> RESERVING
Submit(r) ==
    /\ rq[r] = "-" \/ (rq[r] = "CLOSED" /\ r = RETRY /\ att[r] = 0 /\ outcome[Cur(r)] \in {"503", "gone"})
    /\ att' = [att EXCEPT ![r] = IF rq[r] = "CLOSED" THEN 1 ELSE 0]
    /\ rq' = [rq EXCEPT ![r] = "RESERVING"]
    /\ net' = net \cup {Msg("Reserve", Lease(r, IF rq[r] = "CLOSED" THEN 1 ELSE 0), "-")}
    /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, gone, outcome, corrupt, faults, Flags>>)

\* RESERVING --lease--> TRANSFERRING (client there) | CLOSED (client left: SendAbort writer done)
\* RESERVING --reserve_failed--> CLOSED
RouterLease(m) ==
    /\ m.t = "Lease" /\ m \in net /\ m.l = Cur(Req(m.l)) /\ rq[Req(m.l)] = "RESERVING"
    /\ IF m.x = "ok"
       THEN IF gone[m.l]
            THEN rq' = [rq EXCEPT ![Req(m.l)] = "CLOSED"] /\ net' = (net \ {m}) \cup {Msg("Abort", m.l, "wd")}
            ELSE rq' = [rq EXCEPT ![Req(m.l)] = "TRANSFERRING"] /\ net' = (net \ {m}) \cup {Msg("Prefill", m.l, "-")}
       ELSE rq' = [rq EXCEPT ![Req(m.l)] = "CLOSED"] /\ Recv(m)
    /\ outcome' = [outcome EXCEPT ![m.l] = IF @ = "open" THEN (IF m.x = "ok" THEN @ ELSE m.x) ELSE @]
    /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, att, gone, corrupt, faults, Flags>>)

\* RESERVING --reserve_failed--> CLOSED: the reservation's answer can no longer come (503)
ReserveTimeout(r) ==
    /\ rq[r] = "RESERVING" /\ ~\E m \in net : m.l = Cur(r) /\ m.t \in {"Reserve", "Lease"}
    /\ rq' = [rq EXCEPT ![r] = "CLOSED"] /\ End(Cur(r), "503")
    /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, att, gone, corrupt, net, faults, Flags>>)

\* TRANSFERRING --acked--> STREAMING | CLOSED (client left: SendAbort writer done)
\* TRANSFERRING --refused--> CLOSED (SendAbort writer done, Fail)
RouterAnswer(m) ==
    /\ m.t = "Ack" /\ m \in net /\ m.l = Cur(Req(m.l)) /\ rq[Req(m.l)] = "TRANSFERRING"
    /\ m.x \in {"200", "400", "500", "503"}
    /\ IF m.x = "200" /\ ~gone[m.l]
       THEN rq' = [rq EXCEPT ![Req(m.l)] = "STREAMING"] /\ Recv(m) /\ UNCHANGED outcome
       ELSE /\ rq' = [rq EXCEPT ![Req(m.l)] = "CLOSED"]
            /\ net' = (net \ {m}) \cup {Msg("Abort", m.l, "wd")}
            /\ End(m.l, m.x)
    /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, att, gone, corrupt, faults, Flags>>)

\* TRANSFERRING --unanswered--> FORGETTING (SendForget): prefill's answer did not come in time. It cannot come
\* when nothing of the lease is in flight and prefill holds no transfer for it (a fair timeout); before that, a
\* timeout is a slow prefill (a fault).
RouterTimeout(r) ==
    /\ rq[r] = "TRANSFERRING" /\ ~\E m \in net : m.t = "Ack" /\ m.l = Cur(r)
    /\ \/ (~\E m \in net : m.l = Cur(r)) /\ xs[Cur(r)] \in {"-", "CLOSED"} /\ UNCHANGED faults
       \/ faults < MaxFaults /\ faults' = faults + 1
    /\ rq' = [rq EXCEPT ![r] = "FORGETTING"] /\ Send(Msg("Forget", Cur(r), "router"))
    /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, att, gone, outcome, corrupt, Flags>>)

\* FORGETTING --forget_answer--> CLOSED (SendAbort, writer done iff prefill said it is not writing; Fail 503)
RouterForgotten(r) ==
    /\ rq[r] = "FORGETTING"
    /\ \/ \E m \in net : /\ m.t = "Forget" /\ m.x = "router-answer" /\ m.l = Cur(r)
                         /\ net' = (net \ {m}) \cup {Msg("Abort", Cur(r), "wd")}  \* it is not writing
       \/ (~\E m \in net : m.l = Cur(r) /\ m.t = "Forget") /\ Send(Msg("Abort", Cur(r), "nowd"))  \* forget timed out
    /\ rq' = [rq EXCEPT ![r] = "CLOSED"] /\ End(Cur(r), "503")
    /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, att, gone, corrupt, faults, Flags>>)

\* STREAMING --final--> CLOSED
RouterFinal(m) ==
    /\ m.t = "Ack" /\ m \in net /\ m.x = "final" /\ m.l = Cur(Req(m.l)) /\ rq[Req(m.l)] = "STREAMING"
    /\ rq' = [rq EXCEPT ![Req(m.l)] = "CLOSED"] /\ Recv(m) /\ End(m.l, "200")
    /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, att, gone, corrupt, faults, Flags>>)

\* STREAMING --left--> CLOSED: the stream's silence limit, once its last event can no longer come (503)
RouterSilence(r) ==
    /\ rq[r] = "STREAMING" /\ dl[Cur(r)] # "RUNNING" /\ ~\E m \in net : m.l = Cur(r) /\ m.x = "final"
    /\ rq' = [rq EXCEPT ![r] = "CLOSED"] /\ End(Cur(r), "503") /\ Send(Msg("Abort", Cur(r), "wd"))
    /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, att, gone, corrupt, faults, Flags>>)

\* RESERVING|TRANSFERRING|FORGETTING --left--> RESERVING|TRANSFERRING|FORGETTING (guarded: the step runs on)
\* STREAMING --left--> CLOSED (SendAbort writer done)
Leave(r) ==
    /\ faults < MaxFaults /\ rq[r] \in {"RESERVING", "TRANSFERRING", "FORGETTING", "STREAMING"}
    /\ ~gone[Cur(r)]
    /\ faults' = faults + 1
    /\ gone' = [gone EXCEPT ![Cur(r)] = TRUE] /\ End(Cur(r), "gone")
    /\ IF rq[r] = "STREAMING"
       THEN rq' = [rq EXCEPT ![r] = "CLOSED"] /\ Send(Msg("Abort", Cur(r), "wd"))
       ELSE UNCHANGED <<rq, net>>
    /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, att, corrupt, Flags>>)

(* ---------------------------------------- decode ---------------------------------------------------------- *)
\* - --reserve--> RESERVED (one open lease per request id; a page, or 503)
Reserve(m) ==
    /\ m.t = "Reserve" /\ m \in net
    /\ IF (\E p \in Pages : pst[p] = "FREE") /\ ~\E k \in Leases : Req(k) = Req(m.l) /\ Open(k)
       THEN \E p \in Pages :
            /\ pst[p] = "FREE"
            /\ pst' = [pst EXCEPT ![p] = "RESERVED"] /\ pown' = [pown EXCEPT ![p] = Req(m.l)]
            /\ dl' = [dl EXCEPT ![m.l] = "RESERVED"] /\ dpg' = [dpg EXCEPT ![m.l] = p]
            /\ lgen' = [lgen EXCEPT ![m.l] = pgen[p]] /\ capep' = [capep EXCEPT ![m.l] = epoch]
            /\ net' = (net \ {m}) \cup {Msg("Lease", m.l, "ok")}
            /\ UNCHANGED <<pgen, pdat>>
       ELSE net' = (net \ {m}) \cup {Msg("Lease", m.l, "503")} /\ UNCHANGED <<dl, dpg, lgen, capep, PoolVars>>
    /\ Unchanged(<<expired, epoch, PreVars, RtrVars, faults, Flags>>)

\* RESERVED --commit--> VERIFYING | QUARANTINED (coverage fails: Quarantine, End 500, Reply)
\* RUNNING --commit--> RUNNING (a duplicate)
Commit(m) ==
    /\ m.t = "Commit" /\ m.x = "commit" /\ m \in net
    /\ LET l == m.l
           capok == capep[l] = epoch /\ (~expired[l] \/ Variant = "commit_after_expiry")
           ks == DecodeLease(l)
       IN IF ~capok \/ ks = {}
          THEN net' = (net \ {m}) \cup {Msg("Ack", l, "d503")} /\ UNCHANGED <<dl, PoolVars, stale>>
          ELSE LET k == CHOOSE k \in ks : TRUE IN
               IF dl[k] # "RESERVED"  \* RUNNING: a duplicate, already accepted; otherwise revoked
               THEN net' = (net \ {m}) \cup {Msg("Ack", l, IF dl[k] = "RUNNING" THEN "d200" ELSE "d503")}
                    /\ UNCHANGED <<dl, PoolVars, stale>>
               ELSE IF ~xfull[l] /\ Variant # "no_coverage"
               THEN /\ dl' = [dl EXCEPT ![k] = "QUARANTINED"]
                    /\ pst' = [pst EXCEPT ![dpg[k]] = "QUARANTINED"]
                    /\ net' = (net \ {m}) \cup {Msg("Ack", l, "d500")}
                    /\ UNCHANGED <<pown, pgen, pdat, stale>>
               ELSE /\ dl' = [dl EXCEPT ![k] = "VERIFYING"]
                    /\ net' = (net \ {m}) \cup {Msg("Commit", l, "verify")}
                    /\ stale' = (stale \/ expired[k])  \* a commit accepted for a lease past its TTL
                    /\ UNCHANGED PoolVars
    /\ Unchanged(<<dpg, lgen, capep, expired, epoch, PreVars, RtrVars, faults, leak, badwrite>>)

\* VERIFYING --verified--> RUNNING (tags and checksum hold: Start) | QUARANTINED (they fail)
\* QUARANTINED --verified--> QUARANTINED (aborted while verifying)
Verified(m) ==
    /\ m.t = "Commit" /\ m \in net /\ m.x = "verify"
    /\ LET l == m.l
           ks == {k \in Leases : Req(k) = Req(l) /\ dl[k] \in {"VERIFYING", "QUARANTINED"} /\ Nonce(k) = Nonce(l)}
       IN IF ks = {} THEN net' = (net \ {m}) \cup {Msg("Ack", l, "d503")} /\ UNCHANGED <<dl, PoolVars, leak>>
          ELSE LET k == CHOOSE k \in ks : TRUE
                   p == dpg[k]
                   tags == pst[p] = "RESERVED" /\ pown[p] = Req(k) /\ pgen[p] = lgen[k]
                   sum == pdat[p] # NONE /\ pdat[p][1] = l
               IN IF dl[k] = "QUARANTINED" THEN net' = (net \ {m}) \cup {Msg("Ack", l, "d503")}
                                              /\ UNCHANGED <<dl, PoolVars, leak>>
                  ELSE IF tags /\ sum
                  THEN /\ dl' = [dl EXCEPT ![k] = "RUNNING"] /\ pst' = [pst EXCEPT ![p] = "OWNED"]
                       /\ net' = (net \ {m}) \cup {Msg("Ack", l, "d200")}
                       \* the read: the page must hold this lease's whole prompt, under this lease
                       /\ leak' = (leak \/ pdat[p] # <<k, TRUE>> \/ Req(k) = OVER)
                       /\ UNCHANGED <<pown, pgen, pdat>>
                  ELSE /\ dl' = [dl EXCEPT ![k] = "QUARANTINED"] /\ pst' = [pst EXCEPT ![p] = "QUARANTINED"]
                       /\ net' = (net \ {m}) \cup {Msg("Ack", l, "d500")}
                       /\ UNCHANGED <<pown, pgen, pdat, leak>>
    /\ Unchanged(<<dpg, lgen, capep, expired, epoch, PreVars, RtrVars, faults, badwrite, stale>>)

\* RUNNING --finished--> CLOSED (the request's last event goes to its router)
Finish(l) ==
    /\ dl[l] = "RUNNING"
    /\ dl' = [dl EXCEPT ![l] = "CLOSED"] /\ FreePage(dpg[l]) /\ UNCHANGED pdat
    /\ Send(Msg("Ack", l, "final"))
    /\ Unchanged(<<dpg, lgen, capep, expired, epoch, PreVars, RtrVars, faults, Flags>>)

\* RESERVED|VERIFYING --abort|router_gone--> QUARANTINED (router_gone is decode's own abort, no writer done)
\* RESERVED|VERIFYING --abort--> CLOSED (the writer is known done: Release)
\* QUARANTINED --abort--> CLOSED (the writer is known done)
\* RUNNING --abort|router_gone--> CLOSED (Stop)
\* RESERVED|VERIFYING --abort--> CLOSED (deferred release off: Free; the free_on_abort variant)
Abort(m) ==
    /\ m.t = "Abort" /\ m \in net
    /\ LET ks == DecodeLease(m.l) IN
       IF ks = {} THEN Recv(m) /\ UNCHANGED <<dl, PoolVars>>
       ELSE LET k == CHOOSE k \in ks : TRUE
                p == dpg[k]
                close == dl[k] = "RUNNING" \/ m.x = "wd" \/ Variant = "free_on_abort"
            IN /\ Recv(m)
               /\ IF close
                  THEN dl' = [dl EXCEPT ![k] = "CLOSED"] /\ FreePage(p) /\ UNCHANGED pdat
                  ELSE IF dl[k] = "QUARANTINED" THEN UNCHANGED <<dl, PoolVars>>
                  ELSE dl' = [dl EXCEPT ![k] = "QUARANTINED"] /\ pst' = [pst EXCEPT ![p] = "QUARANTINED"]
                       /\ UNCHANGED <<pown, pgen, pdat>>
    /\ Unchanged(<<dpg, lgen, capep, expired, epoch, PreVars, RtrVars, faults, Flags>>)

\* QUARANTINED --writer_done--> CLOSED (Release); the capability must be current
WriterDone(m) ==
    /\ m.t = "WriterDone" /\ m \in net /\ Recv(m)
    /\ LET ks == {k \in DecodeLease(m.l) : dl[k] = "QUARANTINED"} IN
       IF ks = {} \/ capep[m.l] # epoch THEN UNCHANGED <<dl, PoolVars>>
       ELSE LET k == CHOOSE k \in ks : TRUE IN
            dl' = [dl EXCEPT ![k] = "CLOSED"] /\ FreePage(dpg[k]) /\ UNCHANGED pdat
    /\ Unchanged(<<dpg, lgen, capep, expired, epoch, PreVars, RtrVars, faults, Flags>>)

\* time passes: a lease never committed outlives its TTL. For a quarantined lease that is just time (fair); for
\* one still waiting for its commit it is the race the TTL exists for, counted as a fault to bound the search.
Idle(l) == ~\E m \in net : m.l = l /\ m.t \in {"Prefill", "Commit"}
           /\ xs[l] \notin {"COMPUTING", "WRITING", "COMMITTING"}
Tick(l) == /\ ~expired[l]
           /\ \/ (dl[l] = "QUARANTINED" \/ (dl[l] = "RESERVED" /\ Idle(l))) /\ UNCHANGED faults
              \/ dl[l] \in {"RESERVED", "VERIFYING"} /\ faults < MaxFaults /\ faults' = faults + 1
           /\ expired' = [expired EXCEPT ![l] = TRUE]
           /\ Unchanged(<<dl, dpg, lgen, capep, PoolVars, epoch, PreVars, RtrVars, net, Flags>>)

\* RESERVED|VERIFYING --expire--> QUARANTINED (AskForget)
\* QUARANTINED --expire--> QUARANTINED (AskForget again)
Expire(l) ==
    /\ expired[l] /\ dl[l] \in {"RESERVED", "VERIFYING", "QUARANTINED"}
    /\ ~\E m \in net : m.t = "Forget" /\ m.l = l /\ m.x \in {"decode", "decode-answer"}
    /\ dl' = [dl EXCEPT ![l] = "QUARANTINED"] /\ pst' = [pst EXCEPT ![dpg[l]] = "QUARANTINED"]
    /\ Send(Msg("Forget", l, "decode"))
    /\ Unchanged(<<dpg, lgen, capep, expired, pown, pgen, pdat, epoch, PreVars, RtrVars, faults, Flags>>)

\* QUARANTINED --forget_answer--> CLOSED (Release), when the writer says it is not writing
ForgetAnswer(m) ==
    /\ m.t = "Forget" /\ m \in net /\ m.x = "decode-answer" /\ Recv(m)
    /\ IF dl[m.l] = "QUARANTINED"
       THEN dl' = [dl EXCEPT ![m.l] = "CLOSED"] /\ FreePage(dpg[m.l]) /\ UNCHANGED pdat
       ELSE UNCHANGED <<dl, PoolVars>>
    /\ Unchanged(<<dpg, lgen, capep, expired, epoch, PreVars, RtrVars, faults, Flags>>)

\* RESERVED|VERIFYING|QUARANTINED --fence--> CLOSED (Release): the writer is declared dead (rightly or not)
Fence ==
    /\ faults < MaxFaults /\ faults' = faults + 1
    /\ epoch' = IF Variant = "fence_without_epoch" THEN epoch ELSE epoch + 1
    /\ LET gone_ == {l \in Leases : dl[l] \in {"RESERVED", "VERIFYING", "QUARANTINED"}}
           freed == {dpg[l] : l \in gone_}
       IN /\ dl' = [l \in Leases |-> IF l \in gone_ THEN "CLOSED" ELSE dl[l]]
          /\ pst' = [p \in Pages |-> IF p \in freed THEN "FREE" ELSE pst[p]]
          /\ pown' = [p \in Pages |-> IF p \in freed THEN NOBODY ELSE pown[p]]
          /\ pgen' = [p \in Pages |-> IF p \in freed /\ Variant # "lease_reuse" THEN pgen[p] + 1 ELSE pgen[p]]
    /\ Unchanged(<<dpg, lgen, capep, expired, pdat, PreVars, RtrVars, net, Flags>>)

(* ---------------------------------------- prefill --------------------------------------------------------- *)
\* - --prefill--> COMPUTING (admission first and final; a forgotten or done lease is refused)
\* COMPUTING|WRITING|COMMITTING --prefill--> COMPUTING|WRITING|COMMITTING (a copy: dropped, the original answers)
Prefill(m) ==
    /\ m.t = "Prefill" /\ m \in net /\ pup
    /\ IF xs[m.l] \in {"COMPUTING", "WRITING", "COMMITTING"} THEN Recv(m) /\ UNCHANGED <<xs, xfull, corrupt, faults>>
       ELSE IF Nonce(m.l) \in forgotten \/ xs[m.l] # "-"
       THEN net' = (net \ {m}) \cup {Msg("Ack", m.l, "503")} /\ UNCHANGED <<xs, xfull, corrupt, faults>>
       ELSE IF Req(m.l) = OVER
            THEN \/ /\ Variant = "placeholder" \/ faults < MaxFaults  \* the 2026 placeholder (bug or fault)
                    /\ faults' = IF Variant = "placeholder" THEN faults ELSE faults + 1
                    /\ corrupt' = [corrupt EXCEPT ![m.l] = Variant # "placeholder"]
                    /\ xs' = [xs EXCEPT ![m.l] = "COMPUTING"] /\ xfull' = [xfull EXCEPT ![m.l] = FALSE]
                    /\ Recv(m)
                 \/ /\ Variant # "placeholder"
                    /\ net' = (net \ {m}) \cup {Msg("Ack", m.l, "400")} /\ UNCHANGED <<xs, xfull, corrupt, faults>>
            ELSE xs' = [xs EXCEPT ![m.l] = "COMPUTING"] /\ Recv(m) /\ UNCHANGED <<xfull, corrupt, faults>>
    /\ Unchanged(<<DecVars, PoolVars, epoch, forgotten, pup, rq, att, gone, outcome, Flags>>)

\* COMPUTING --prefilled--> WRITING
Prefilled(l) ==
    /\ pup /\ xs[l] = "COMPUTING" /\ xs' = [xs EXCEPT ![l] = "WRITING"]
    /\ Unchanged(<<DecVars, PoolVars, epoch, xfull, forgotten, pup, RtrVars, net, faults, Flags>>)

\* WRITING --written--> COMMITTING (SendCommit) | CLOSED (the transport refused a fenced writer: 503)
\* The write lands whole on decode's page, unless the capability's epoch is dead there.
Write(l) ==
    /\ pup /\ xs[l] = "WRITING"
    /\ LET p == dpg[l] IN
       IF capep[l] = epoch
       THEN /\ pdat' = [pdat EXCEPT ![p] = <<l, xfull[l]>>]
            /\ badwrite' = (badwrite \/ ~(pown[p] = Req(l) /\ pgen[p] = lgen[l]
                                          /\ pst[p] \in {"RESERVED", "QUARANTINED"}))
            /\ xs' = [xs EXCEPT ![l] = "COMMITTING"] /\ Send(Msg("Commit", l, "commit"))
            /\ UNCHANGED forgotten
       ELSE /\ xs' = [xs EXCEPT ![l] = "CLOSED"] /\ forgotten' = forgotten \cup {Nonce(l)}
            /\ Send(Msg("Ack", l, "503")) /\ UNCHANGED <<pdat, badwrite>>
    /\ Unchanged(<<DecVars, pst, pown, pgen, epoch, xfull, pup, RtrVars, faults, leak, stale>>)

\* COMMITTING --acked--> CLOSED (accepted: ReleaseOwn, Settle) | (refused: ReleaseOwn, SendWriterDone, Settle)
Acked(m) ==
    /\ m.t = "Ack" /\ m \in net /\ m.x \in {"d200", "d500", "d503"} /\ pup /\ xs[m.l] = "COMMITTING"
    /\ xs' = [xs EXCEPT ![m.l] = "CLOSED"] /\ forgotten' = forgotten \cup {Nonce(m.l)}
    /\ net' = (net \ {m}) \cup
              (IF m.x = "d200" THEN {Msg("Ack", m.l, "200")}
               ELSE {Msg("WriterDone", m.l, "-"), Msg("Ack", m.l, IF m.x = "d500" THEN "500" ELSE "503")})
    /\ Unchanged(<<DecVars, PoolVars, epoch, xfull, pup, RtrVars, faults, Flags>>)

\* COMMITTING --acked--> CLOSED, undelivered: decode's answer never came (lost, or decode revoked it unanswered)
CommitTimeout(l) ==
    /\ pup /\ xs[l] = "COMMITTING" /\ ~\E m \in net : m.l = l /\ m.t \in {"Commit", "Ack"}
    /\ xs' = [xs EXCEPT ![l] = "CLOSED"] /\ forgotten' = forgotten \cup {Nonce(l)}
    /\ net' = net \cup {Msg("WriterDone", l, "-"), Msg("Ack", l, "503")}
    /\ Unchanged(<<DecVars, PoolVars, epoch, xfull, pup, RtrVars, faults, Flags>>)

\* COMPUTING --forget--> CLOSED (StopCompute, Settle 503)
\* WRITING|COMMITTING --forget--> WRITING|COMMITTING (a write may land: no answer)
PrefillForget(m) ==
    /\ m.t = "Forget" /\ m \in net /\ m.x \in {"router", "decode"} /\ pup
    /\ forgotten' = forgotten \cup {Nonce(m.l)}
    /\ LET writing == xs[m.l] \in {"WRITING", "COMMITTING"}
           answer == Msg("Forget", m.l, IF m.x = "router" THEN "router-answer" ELSE "decode-answer")
       IN IF xs[m.l] = "COMPUTING"
          THEN xs' = [xs EXCEPT ![m.l] = "CLOSED"] /\ net' = (net \ {m}) \cup {answer, Msg("Ack", m.l, "503")}
          ELSE UNCHANGED xs /\ net' = IF writing THEN net \ {m} ELSE (net \ {m}) \cup {answer}
    /\ Unchanged(<<DecVars, PoolVars, epoch, xfull, pup, RtrVars, faults, Flags>>)

\* COMPUTING --failed--> CLOSED: the engine fails the request (a fault), prefill answers 503
Failed(l) ==
    /\ pup /\ xs[l] = "COMPUTING" /\ faults < MaxFaults /\ faults' = faults + 1
    /\ xs' = [xs EXCEPT ![l] = "CLOSED"] /\ forgotten' = forgotten \cup {Nonce(l)} /\ Send(Msg("Ack", l, "503"))
    /\ Unchanged(<<DecVars, PoolVars, epoch, xfull, pup, RtrVars, Flags>>)

\* the prefill worker dies: every transfer is gone, with its answers; it comes back empty
Crash ==
    /\ pup /\ faults < MaxFaults /\ faults' = faults + 1
    /\ pup' = FALSE
    /\ xs' = [l \in Leases |-> IF xs[l] \in {"COMPUTING", "WRITING", "COMMITTING"} THEN "CLOSED" ELSE xs[l]]
    /\ forgotten' = forgotten \cup {Nonce(l) : l \in {k \in Leases : xs[k] # "-"}}
    /\ Unchanged(<<DecVars, PoolVars, epoch, xfull, RtrVars, net, Flags>>)
Restart == ~pup /\ pup' = TRUE
           /\ Unchanged(<<DecVars, PoolVars, epoch, xs, xfull, forgotten, RtrVars, net, faults, Flags>>)
\* a message to a dead prefill is lost; decode's answer to a commit whose transfer is gone goes nowhere
DeadLetter(m) == /\ m \in net
                 /\ \/ ~pup /\ m.t \in {"Prefill", "Forget"} /\ m.x \in {"-", "router", "decode"}
                    \/ m.t = "Ack" /\ m.x \in {"d200", "d500", "d503"} /\ xs[m.l] # "COMMITTING"
                    \/ m.t = "Ack" /\ m.x = "final" /\ ~(m.l = Cur(Req(m.l)) /\ rq[Req(m.l)] = "STREAMING")
                 /\ Recv(m) /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, RtrVars, faults, Flags>>)

(* ---------------------------------------- network --------------------------------------------------------- *)
Lose(m) == /\ faults < MaxFaults /\ m \in net /\ m.x # "verify"
           /\ faults' = faults + 1 /\ Recv(m)
           /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, RtrVars, Flags>>)
\* the network will deliver this message a second time, later (after the first copy was taken). Only the
\* messages that act on a lease by its id (abort, commit, writer-done): a late copy of one is what a reused
\* lease identity would take for its own. (The simulator duplicates every message.)
Duplicate(m) == /\ faults < MaxFaults /\ m \in net /\ m.t \in {"Abort", "Commit", "WriterDone"}
                /\ m.x # "verify" /\ m \notin late
                /\ faults' = faults + 1 /\ late' = late \cup {m}
                /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, RtrVars, net, Flags>>)
Redeliver(m) == /\ m \in late /\ m \notin net /\ net' = net \cup {m} /\ late' = late \ {m}
                /\ Unchanged(<<DecVars, PoolVars, epoch, PreVars, RtrVars, faults, Flags>>)

\* Every action's first conjuncts are its cheapest guards (a message's type before its membership in net, the
\* fault budget first): TLC evaluates a conjunction left to right, and the order alone took its exhaustive run
\* from 249 to 204 CPU-s, the same states. A message goes only to the steps that take its type (CASE): a tenth
\* less again.
Deliver(m) == CASE m.t = "Ack" -> RouterAnswer(m) \/ RouterFinal(m) \/ Acked(m) \/ DeadLetter(m)
                [] m.t = "Commit" -> Commit(m) \/ Verified(m)
                [] m.t = "Abort" -> Abort(m)
                [] m.t = "Forget" -> ForgetAnswer(m) \/ PrefillForget(m) \/ DeadLetter(m)
                [] m.t = "Prefill" -> Prefill(m) \/ DeadLetter(m)
                [] m.t = "Reserve" -> Reserve(m)
                [] m.t = "Lease" -> RouterLease(m)
                [] m.t = "WriterDone" -> WriterDone(m)

Work ==
    \/ \E r \in Reqs : Submit(r) \/ ReserveTimeout(r) \/ RouterTimeout(r) \/ RouterForgotten(r) \/ RouterSilence(r)
    \/ \E m \in net : Deliver(m)
    \/ \E l \in Leases : Finish(l) \/ Tick(l) \/ Expire(l) \/ Prefilled(l) \/ Write(l) \/ CommitTimeout(l)
    \/ Restart
Chaos == (\E r \in Reqs : Leave(r)) \/ (\E m \in net : Lose(m)) \/ (\E l \in Leases : Failed(l)) \/ Crash \/ Fence

\* Duplicate and Redeliver are the only steps that change late (a redelivery is not a fault: it is the second
\* copy of one, so it counts nothing)
Next == ((Work \/ Chaos) /\ UNCHANGED late) \/ (\E m \in net : Duplicate(m)) \/ (\E m \in late : Redeliver(m))

\* every step that is not a fault is eventually taken while it stays possible: per request, per lease, and per
\* lease and message type (so that no message is passed over for ever)
Fairness ==
    /\ \A r \in Reqs : /\ WF_vars((Submit(r)) /\ UNCHANGED late) /\ WF_vars((ReserveTimeout(r)) /\ UNCHANGED late) /\ WF_vars((RouterTimeout(r)) /\ UNCHANGED late)
                     /\ WF_vars((RouterForgotten(r)) /\ UNCHANGED late) /\ WF_vars((RouterSilence(r)) /\ UNCHANGED late)
    /\ \A l \in Leases : /\ WF_vars((Finish(l)) /\ UNCHANGED late) /\ WF_vars((Tick(l)) /\ UNCHANGED late) /\ WF_vars((Expire(l)) /\ UNCHANGED late) /\ WF_vars((Prefilled(l)) /\ UNCHANGED late)
                       /\ WF_vars((Write(l)) /\ UNCHANGED late) /\ WF_vars((CommitTimeout(l)) /\ UNCHANGED late)
    /\ \A l \in Leases, t \in MsgTypes : WF_vars((\E m \in net : m.l = l /\ m.t = t /\ Deliver(m)) /\ UNCHANGED late)
    /\ WF_vars((Restart) /\ UNCHANGED late)
Spec == Init /\ [][Next]_vars /\ Fairness

(* ---------------------------------------- properties ------------------------------------------------------ *)
NoForeignRead == ~leak              \* no request reads a page not written for it under its lease (or over-long)
NoReusedPageWritten == ~badwrite    \* no write lands in a page that is no longer its lease's
NoExpiredServed == ~stale           \* no lease is served after its capability expired
RightStatus == \A l \in Leases :
    /\ outcome[l] = "400" => Req(l) = OVER
    /\ outcome[l] = "500" => corrupt[l]
    /\ outcome[l] = "200" => Req(l) # OVER
Conserved == \A p \in Pages :
    /\ (pst[p] = "FREE") <=> (pown[p] = NOBODY)
    /\ pst[p] # "FREE" => \E l \in Leases : dl[l] \in {"RESERVED", "VERIFYING", "RUNNING", "QUARANTINED"}
                                           /\ dpg[l] = p /\ Req(l) = pown[p]
TypeOK == /\ dl \in [Leases -> LeaseStates] /\ xs \in [Leases -> WriteStates] /\ rq \in [Reqs -> RequestStates]
          /\ \A m \in net : m.t \in MsgTypes
Safety == TypeOK /\ NoForeignRead /\ NoReusedPageWritten /\ NoExpiredServed /\ RightStatus /\ Conserved

AllEnded == \A r \in Reqs : rq[r] = "CLOSED"
Drained == \A p \in Pages : pst[p] = "FREE"
EveryRequestEnds == <>[](AllEnded /\ Drained)
=============================================================================
