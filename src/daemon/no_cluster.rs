//! The edge build (without the `kube` feature) has no adaptive side. The
//! loop keeps one shape: its `Option<Adaptive>` is always `None`, and this
//! uninhabited type lets the compiler prove the adaptive branches are never
//! taken, with no Kubernetes code compiled in.

use std::os::fd::BorrowedFd;
use std::time::Instant;

use crate::engine::request::Command;
use crate::engine::{Engine, Outcome};

/// A parked request's outcome for its connection.
pub type Delivery = (u64, Outcome);

/// No value of this type exists.
pub enum Adaptive {}

impl Adaptive {
    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        match *self {}
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        match *self {}
    }

    pub fn intercept(
        &mut self,
        _conn_id: u64,
        _command: Command,
        _outcome: Outcome,
        _now: Instant,
    ) -> Option<Outcome> {
        match *self {}
    }

    pub fn on_wake(&mut self, _engine: &mut Engine, _now: Instant) -> Vec<Delivery> {
        match *self {}
    }

    pub fn retry_woken(&mut self, _engine: &mut Engine) -> Vec<Delivery> {
        match *self {}
    }

    pub fn tick(&mut self, _engine: &mut Engine, _now: Instant) -> Vec<Delivery> {
        match *self {}
    }

    pub fn shutdown(&mut self, _now: Instant) -> Vec<Delivery> {
        match *self {}
    }

    pub fn forget(&mut self, _conn_id: u64) {
        match *self {}
    }
}
